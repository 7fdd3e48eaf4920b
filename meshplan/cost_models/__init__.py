"""Cost model: pure functions (profile, cluster, layout, shapes) -> time, memory, communication."""

from meshplan.cost_models.estimate import PRECISIONS, Estimate, estimate_profile
from meshplan.cost_models.layout import SCHEDULES, Layout, check_layout

__all__ = ["Estimate", "Layout", "estimate_profile", "check_layout", "PRECISIONS", "SCHEDULES"]
