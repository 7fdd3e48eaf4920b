"""The data the cost model is validated against ships inside the package (meshplan/data), so a
clone with nothing beside it passes the README's test command; where the project's shared data
folder sits beside the clone (../shared/data), the shipped run table and its README must be
identical to it. The shipped GPU table may add parts the shared one lacks (datasheet facts, each
row with its sources) but must hold every shared row unchanged."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from meshplan.cost_models.validation import DEFAULT_CSV, load_rows

PACKAGE_DATA = Path(DEFAULT_CSV).parent
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FILES = ("published_runs.csv", "README.md", "hardware.csv")


def test_the_published_runs_ship_with_the_package():
    assert PACKAGE_DATA == Path(__file__).resolve().parents[1] / "meshplan" / "data"
    for name in FILES:
        assert (PACKAGE_DATA / name).is_file(), name
    assert len(load_rows()) >= 100


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared data folder beside this clone")
@pytest.mark.parametrize("name", ("published_runs.csv", "README.md"))
def test_shipped_data_is_identical_to_the_shared_folder(name):
    shipped, shared = (PACKAGE_DATA / name).read_bytes(), (SHARED / name).read_bytes()
    assert shipped == shared, (f"meshplan/data/{name} differs from {SHARED / name}: "
                               f"copy it over (cp {SHARED / name} meshplan/data/)")


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared data folder beside this clone")
def test_shipped_gpu_table_holds_every_shared_row_and_cites_its_additions():
    shipped = list(csv.DictReader(io.StringIO((PACKAGE_DATA / "hardware.csv").read_text())))
    shared = list(csv.DictReader(io.StringIO((SHARED / "hardware.csv").read_text())))
    assert list(shipped[0]) == list(shared[0]), "the column headers differ"
    missing = [r["gpu"] for r in shared if r not in shipped]
    assert not missing, (f"rows of {SHARED / 'hardware.csv'} missing or changed in meshplan/data: "
                         f"{missing}")
    for row in shipped:
        if row not in shared:
            assert row["spec_sources"].strip() and row["bf16_dense_tflops"].strip(), row["gpu"]
