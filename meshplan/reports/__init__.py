"""Reports built on the planner: what-if capacity sweeps (`whatif`), their terminal / Markdown /
JSON / HTML renderings with inline SVG plots, and single-plan HTML reports (the exports to other
frameworks are meshplan.export). Submodules are imported on use; importing this package costs nothing."""
