"""dprun-report's audit columns, from summary.json's "audit" (absent: the run was not audited, NaN)."""
from __future__ import annotations

import math
from typing import Any

from runner.epsilon_shown import shown_lower_bound

COLUMNS = ("audit_kind", "audited_epsilon", "audited_epsilon_fdp", "audit_ceiling", "audit_above_claimed")


def audit_columns(summary: dict[str, Any]) -> dict[str, Any]:
    audit = summary.get("audit") if isinstance(summary.get("audit"), dict) else {}
    return {"audit_kind": audit.get("kind"),
            "audited_epsilon": audit.get("epsilon_lower_bound", math.nan),
            "audited_epsilon_fdp": audit.get("epsilon_lower_bound_fdp", math.nan),
            "audit_ceiling": audit.get("ceiling", math.nan),
            "audit_above_claimed": audit.get("above_claimed")}


def audited_text(bound: Any, bound_fdp: Any, above: Any) -> str:
    """">= 0.32 (f-DP 0.39)", each bound rounded down; "AUDIT FAILED >= 9.1 ..." when a bound is above the claimed
    epsilon; "" unaudited."""
    if bound is None or (isinstance(bound, float) and math.isnan(bound)):
        return ""
    # lower bounds rounded down (review 36: .3g rounded them to nearest, up to half a unit above themselves)
    text = f">= {shown_lower_bound(float(bound), 3)} (f-DP {shown_lower_bound(float(bound_fdp), 3)})"
    return f"AUDIT FAILED {text}" if above is True else text
