"""The models behind dflash-chat: loading, the conversation cache, and the thread they run on.

The app never touches MLX. ``MLXEngine`` runs every MLX call on one long-lived thread (MLX
streams are per thread) and hands back plain Python values: ``GenerationResponse`` objects.
"""

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

from .commands import Settings

StreamFn = Callable[[list[dict[str, str]], Settings], Iterator[Any]]


class MLXThread:
    """One long-lived daemon thread that runs every MLX call handed to it, in order.

    It never exits: a thread that used MLX and ends while the process shuts down can abort
    the process ("terminate called without an active exception", seen with MLX 0.32 on Linux).
    """

    def __init__(self, name: str = "dflash-mlx"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def submit(self, fn: Callable, *args) -> Future:
        """Queue ``fn(*args)`` after the calls already queued; returns its future."""
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def run(self, fn: Callable, *args, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` on the thread and return its result (or raise its exception)."""
        return self.submit(fn, *args).result(timeout)


class MLXEngine:
    """A target + drafter pair and one conversation cache, driven from any thread.

    Every MLX call (loading, prefill, drafting, verifying) runs on one private thread, so
    the thread-local generation stream and the cache's arrays always stay on the thread that
    made them. Callers only ever get plain Python values back. What the adaptive policy
    measured of the pair is kept for the whole session (``policies``, one per drafting setup;
    ``/clear`` keeps it), so a reply does not pay again to learn that drafting loses.

    Args:
        model: Target folder or Hugging Face id; None loads the embedded default pair.
        draft: Drafter folder or Hugging Face id. None takes a pair folder's drafter or the
          official drafter of a known target, and otherwise means plain decoding.
        dtype: Cast both models to this dtype (see ``dflash_mlx.load``).
        no_draft: Plain decoding even when a drafter is available.
        extra_eos_token: More tokens (text or ids) that end a reply, as ``--extra-eos-token``.
        chat_template_config: Keyword arguments for ``apply_chat_template``.
        policy_store: Where what the adaptive policy measured is kept between sessions
          (:class:`dflash_mlx.tuning.policy.PolicyStore`); None: within this session only.
        datastore: ``--datastore``: ``"auto"``, ``"none"`` or a response cache file
          (:func:`dflash_mlx.tools.session.open_datastore`); every reply joins it.
    """

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        *,
        dtype: str | None = None,
        no_draft: bool = False,
        extra_eos_token: list[str] = (),
        chat_template_config: dict[str, Any] | None = None,
        policy_store: Any = None,
        datastore: str = "auto",
    ):
        self.model_path, self.draft_path, self.dtype, self.no_draft = model, draft, dtype, no_draft
        self.datastore_choice, self.datastore = datastore, None
        self.policy_store = policy_store
        self.extra_eos_token, self.template_kwargs = list(extra_eos_token), dict(chat_template_config or {})
        self._thread = MLXThread()
        self.session = None  # the loaded pair (dflash_mlx.tools.session.Session), once load() ran
        self.cache = None
        self.context_tokens: int | None = None
        self._closing = False
        # Called as (done, total) after each prefill chunk, on the model thread (the app posts a message).
        self.on_prefill: Callable[[int, int], None] | None = None

    # The pair as loaded; the drafter may be swapped (tests wrap it to time it).
    model = property(lambda self: self.session.model if self.session else None)
    tokenizer = property(lambda self: self.session.tokenizer if self.session else None)
    draft = property(
        lambda self: self.session.draft if self.session else None,
        lambda self, draft: setattr(self.session, "draft", draft),
    )

    @property
    def policies(self) -> dict:
        """The adaptive policy's state per drafting setup (block size, sampling, cutoff, fallback, tree)."""
        return self.session.policies if self.session else {}

    def _run(self, fn: Callable, *args) -> Any:
        return self._thread.run(fn, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Wait until the cycle in flight (if any) is done, so the process can exit cleanly."""
        self._closing = True
        try:
            self._thread.run(lambda: None, timeout=timeout)
        except FutureTimeoutError:
            pass

    def load(self) -> dict[str, Any]:
        """Load the pair (blocking). Returns what ``ModelReady`` needs. Raises ``DFlashError``."""
        return self._run(self._load)

    def _load(self) -> dict[str, Any]:
        from ..loading.pairs import DEFAULT_PAIR
        from ..loading.registry import loaded_names
        from ..text.chat_template import template_switches
        from ..tools.session import Session

        self.session = Session.open(self.model_path, self.draft_path, no_draft=self.no_draft, dtype=self.dtype,
                                    extra_eos_token=self.extra_eos_token, policy_store=self.policy_store)  # fmt: skip
        self.cache = self.session.make_cache()
        self.datastore = self.session.open_datastore(self.datastore_choice)
        name = DEFAULT_PAIR if self.model_path is None else Path(self.model_path).name
        if self.draft is None:
            name += " (no drafter)"
        else:
            # The drafter is named too, also one taken from a pair folder or the registry.
            _, draft_name = loaded_names(self.model_path, self.session.draft_path)
            name += f" + {_short_name(draft_name)}" if draft_name else ""
        if self.draft is not None and getattr(self.draft, "family", "DFlash") != "DFlash":
            name += f" [{self.draft.family}]"
        return {
            "name": name,
            "has_draft": self.draft is not None,
            "max_block_size": self.draft.block_size if self.draft is not None else None,
            "chat_template": getattr(self.tokenizer, "chat_template", None) is not None,
            "context_limit": getattr(self.model.args, "max_position_embeddings", None),
            "switches": template_switches(self.tokenizer),
        }

    def reset(self) -> None:
        """Forget the conversation (a fresh cache). Returns at once; later calls run after it."""

        def _reset():
            if self.session is not None:
                self.cache = self.session.make_cache()
            self.context_tokens = 0

        self._thread.submit(_reset)

    def _prompt(self, messages: list[dict[str, str]], settings: Settings) -> list[int] | str:
        from ..text.chat_template import render_chat

        # /think's switches over --chat-template-config's.
        args = {**self.template_kwargs, **settings.template_args()}
        return render_chat(self.tokenizer, messages, system_prompt=settings.system_prompt, template_args=args)

    def _start(self, messages: list[dict[str, str]], settings: Settings):
        from ..sampling import make_sampler
        from ..text.chat_template import has_chat_template

        if self.draft is not None:
            # Off keeps the drafter, verifying one token per pass, so its cache stays in sync.
            block_size = settings.block_size if settings.dflash else 1
        else:
            block_size = None
        setup = (block_size, settings.temp > 0, settings.min_confidence, settings.lookup_fallback, settings.tree_budget,
                 settings.confidence_threshold)  # fmt: skip
        return self.session.stream(
            self._prompt(messages, settings),
            max_tokens=settings.max_tokens,
            block_size=block_size,
            sampler=make_sampler(settings.temp, settings.top_p),
            min_confidence=settings.min_confidence,
            confidence_threshold=settings.confidence_threshold,
            lookup_fallback=settings.lookup_fallback,
            tree_budget=settings.tree_budget if settings.dflash else 0,
            setup={"chat": list(setup)},
            prompt_cache=self.cache,
            parse_reasoning=has_chat_template(self.tokenizer),
            prompt_progress_callback=self._prefilled,
        )

    def _prefilled(self, done: int, total: int) -> None:
        if self.on_prefill is not None:
            self.on_prefill(done, total)

    def __call__(self, messages: list[dict[str, str]], settings: Settings) -> Iterator[Any]:
        """Stream a reply to ``messages`` as ``GenerationResponse`` objects, reusing the cache.

        Closing this generator stops generation after the current cycle; the cache then holds
        the partial reply, so the next turn still prefills only its new tokens.
        """
        responses = self._run(self._start, messages, settings)
        try:
            while not self._closing and (response := self._run(next, responses, None)) is not None:
                yield response
        finally:
            self._run(responses.close)
            self.context_tokens = self._run(lambda: len(self.cache.tokens))
            self.session.keep_policies()


class StreamEngine:
    """Adapts a bare ``stream_fn(messages, settings)`` (a fake in tests, another backend)."""

    def __init__(self, stream_fn: StreamFn, *, name: str = "custom stream", max_block_size: int = 16):
        self.stream_fn, self.name, self.max_block_size = stream_fn, name, max_block_size
        self.context_tokens: int | None = None

    def load(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "has_draft": True,
            "max_block_size": self.max_block_size,
            "chat_template": True,
        }

    def reset(self) -> None:
        pass

    def __call__(self, messages: list[dict[str, str]], settings: Settings) -> Iterator[Any]:
        return self.stream_fn(messages, settings)


class RemoteEngine:
    """The chat against an OpenAI-compatible server (``dflash-chat --base-url``).

    Args:
        base_url: The server's API root, e.g. ``http://host:8000/v1``.
        api_key: Its bearer token, if it wants one.
        model: The model id to ask for; None takes the server's first.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None):
        from ..tools.client import RemoteClient

        self.client = RemoteClient(base_url, api_key=api_key, model=model)
        self.context_tokens: int | None = None

    def load(self) -> dict[str, Any]:
        from ..loading.pairs import is_default_pair

        info = self.client.server_info()
        return {
            "name": info.describe(),
            "has_draft": True,
            "max_block_size": info.block_size or 16,
            "chat_template": True,
            "peak_memory_known": False,  # no server reports it
            "default_pair": is_default_pair(info.model),
        }

    def reset(self) -> None:
        self.context_tokens = None

    def close(self) -> None:
        pass

    def __call__(self, messages: list[dict[str, str]], settings: Settings) -> Iterator[Any]:
        if settings.system_prompt:
            messages = [{"role": "system", "content": settings.system_prompt}, *messages]
        params: dict[str, Any] = {"max_tokens": settings.max_tokens, "temperature": settings.temp}
        if 0 < settings.top_p < 1:
            params["top_p"] = settings.top_p
        if self.client.info is not None and self.client.info.kind == "dflash":
            # Our own knobs only for our own server: another may refuse unknown fields.
            block_size = settings.block_size if settings.dflash else 1
            params.update(min_confidence=settings.min_confidence, lookup_fallback=settings.lookup_fallback)
            if settings.confidence_threshold > 0 and settings.dflash:
                params["confidence_threshold"] = settings.confidence_threshold
            if settings.tree_budget and settings.dflash:
                params["tree_budget"] = settings.tree_budget
            if block_size is not None:
                params["block_size"] = block_size
        # Only what /think set: a server that takes neither field would refuse the request.
        if settings.thinking is not None:
            params["chat_template_kwargs"] = {"enable_thinking": settings.thinking}
        if settings.reasoning_effort is not None:
            params["reasoning_effort"] = settings.reasoning_effort
        return self.client.stream_chat(messages, **params)


def _short_name(name: str) -> str:
    """A drafter's name for the settings bar: a hub id as it is, a folder by its own name (a pair
    folder's ``draft/`` with its pair's)."""
    path = name.rsplit(" (", 1)[1][:-1] if name.endswith(")") and " (" in name else name
    folder = Path(path)
    if not (folder.is_absolute() or folder.exists()):
        return path
    return f"{folder.parent.name}/{folder.name}" if folder.name == "draft" else folder.name
