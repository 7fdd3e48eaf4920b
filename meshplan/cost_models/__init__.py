"""Cost model: pure functions (profile, cluster, layout, shapes) -> time, memory, communication.

Reads the shared types of `meshplan.ir` (ModelProfile, Layout) and returns an `ir.Estimate`.
"""
