"""A snapshot of the main screen after one scripted reply (fixed numbers, no model).

Regenerate after a deliberate UI change with ``pytest tests/test_tui_snapshot.py --snapshot-update``.
"""

from pathlib import Path

APP = Path(__file__).parent / "snapshot_app.py"


async def _chat(pilot) -> None:
    app = pilot.app
    for _ in range(500):
        if app.info is not None:
            break
        await pilot.pause(0.01)
    await pilot.press(*"What is DFlash?", "enter")
    await app.workers.wait_for_complete()
    for _ in range(500):
        if not app.generating:
            break
        await pilot.pause(0.01)
    await pilot.pause()


def test_main_screen_after_a_reply(snap_compare):
    assert snap_compare(APP, terminal_size=(100, 30), run_before=_chat)
