"""Server-wide counters and their Prometheus text form (``GET /metrics``).

Names follow vLLM's spec-decode counters with our own prefix (``dflash:spec_decode_num_drafts_total``
and so on), so a client that reads vLLM's counters reads ours the same way.
"""

import threading

from ...text.responses import AcceptanceStats

PREFIX = "dflash:"
COUNTERS = {
    "spec_decode_num_drafts_total": "Verification steps that checked at least one draft token.",
    "spec_decode_num_draft_tokens_total": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens_total": "Draft tokens the target accepted.",
    "plain_decode_num_steps_total": "Steps that verified no draft (plain decoding), left out of the drafts above.",
    "generation_tokens_total": "Tokens generated.",
    "prompt_tokens_total": "Prompt tokens received (before prefix-cache reuse).",
    "request_success_total": "Requests answered in full.",
    "request_cancelled_total": "Requests cut short (client gone or shutdown).",
}
GAUGES = {
    "generation_tokens_per_second": "Generation speed of the last request, tokens per second.",
    "num_requests_running": "Requests being generated now.",
    "batch_rows": "Requests decoded together in the last batched cycle (prefilling ones included).",
    "num_requests_waiting": "Requests waiting in the queue.",
}


class Metrics:
    """Thread-safe counters updated by the worker at the end of each request."""

    def __init__(self):
        self._lock = threading.Lock()
        self.values = {name: 0 for name in COUNTERS}
        self.tps = 0.0
        self.rows = 0
        self.row_acceptance: dict[int, float] = {}

    def batch(self, rows: int, acceptance: dict[int, float]) -> None:
        """The batch now: its rows, and each running row's learned chance that a draft is right."""
        with self._lock:
            self.rows, self.row_acceptance = rows, dict(acceptance)

    def observe(
        self, *, prompt_tokens: int, generation_tokens: int, acceptance: AcceptanceStats, tps: float, finished: bool
    ) -> None:
        with self._lock:
            v = self.values
            v["spec_decode_num_drafts_total"] += acceptance.drafting_cycles
            v["spec_decode_num_draft_tokens_total"] += acceptance.draft_tokens
            v["spec_decode_num_accepted_tokens_total"] += acceptance.accepted_drafts
            v["plain_decode_num_steps_total"] += acceptance.plain_cycles
            v["generation_tokens_total"] += generation_tokens
            v["prompt_tokens_total"] += prompt_tokens
            v["request_success_total" if finished else "request_cancelled_total"] += 1
            if tps > 0:
                self.tps = tps

    def render(self, model_name: str, *, running: int, waiting: int) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{escaped}"}}'
        with self._lock:
            values = dict(self.values)
            gauges = {
                "generation_tokens_per_second": self.tps,
                "num_requests_running": running,
                "num_requests_waiting": waiting,
                "batch_rows": self.rows,
            }
            rows = dict(self.row_acceptance)
        lines = []
        for kind, names, source in (("counter", COUNTERS, values), ("gauge", GAUGES, gauges)):
            for name, text in names.items():
                lines += [
                    f"# HELP {PREFIX}{name} {text}",
                    f"# TYPE {PREFIX}{name} {kind}",
                    f"{PREFIX}{name}{label} {float(source[name])}",
                ]
        name = f"{PREFIX}row_draft_acceptance"
        lines += [f"# HELP {name} Each running request's chance that a draft is right, as its batch row learned it.",
                  f"# TYPE {name} gauge"]  # fmt: skip
        lines += [f'{name}{{model_name="{escaped}",row="{row}"}} {chance}' for row, chance in sorted(rows.items())]
        return "\n".join(lines) + "\n"
