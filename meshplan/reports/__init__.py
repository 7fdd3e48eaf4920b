"""Reports built on the planner: what-if capacity sweeps (`whatif`), their terminal / Markdown /
JSON / HTML renderings with inline SVG plots, single-plan HTML reports, and exports to other
frameworks. Submodules are imported on use; importing this package costs nothing."""
