"""A snapshot of the main screen after one scripted reply (fixed numbers, no model).

Regenerate after a deliberate UI change with ``pytest tests/test_tui_snapshot.py --snapshot-update``.
"""

from pathlib import Path

from helpers.snapshot_app import wait_until

from dflash_mlx.tui.widgets import PromptInput

APP = Path(__file__).parent / "helpers" / "snapshot_app.py"


async def _chat(pilot) -> None:
    app = pilot.app
    # A blinking cursor is drawn or not depending on when the screen is taken: keep it on.
    app.query_one(PromptInput).cursor_blink = False
    await wait_until(pilot, lambda: app.info is not None)
    await pilot.press(*"What is DFlash?", "enter")
    await app.workers.wait_for_complete()
    await wait_until(pilot, lambda: not app.generating and len(app.turns) == 2)
    await pilot.pause()


def test_main_screen_after_a_reply(snap_compare):
    assert snap_compare(APP, terminal_size=(100, 30), run_before=_chat)
