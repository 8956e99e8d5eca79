"""dflash-chat: a Textual terminal chat app for DFlash."""
