"""`python -m meshplan.cli ...` (what torchrun runs on every rank)."""

from meshplan.cli import main

raise SystemExit(main())
