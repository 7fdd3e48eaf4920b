"""The data the cost model is validated against ships inside the package (meshplan/data), so a
clone with nothing beside it passes the README's test command; where the project's shared data
folder sits beside the clone (../shared/data), the shipped copies must be identical to it."""

from __future__ import annotations

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
@pytest.mark.parametrize("name", FILES)
def test_shipped_data_is_identical_to_the_shared_folder(name):
    shipped, shared = (PACKAGE_DATA / name).read_bytes(), (SHARED / name).read_bytes()
    assert shipped == shared, (f"meshplan/data/{name} differs from {SHARED / name}: "
                               f"copy it over (cp {SHARED / name} meshplan/data/)")
