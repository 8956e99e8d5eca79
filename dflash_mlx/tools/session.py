"""What every tool sets up before its first token, in one place: the pair, its stop tokens, the
datastore, the pair caches and the adaptive policy's state.

dflash-generate, dflash-chat, dflash-serve and dflash-bench open a :class:`Session` from their
flags and then ask it for what they run: a fresh cache, the policy state of a drafting setup, a
stream of replies through the public :func:`dflash_mlx.stream_generate`. Importing this module
loads no model library (the tools start fast); opening a session does.
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.errors import DFlashError
from ..loading.pairs import default_pair_answers
from ..tuning.policy import PolicyState, PolicyStore

if TYPE_CHECKING:
    from ..drafts.datastore import Datastore


def open_datastore(choice: str | None, model: str | Path | None, vocab: int, **settings) -> "Datastore | None":
    """The datastore a tool's ``--datastore`` asks for.

    Args:
        choice: ``"auto"`` (or None): the default pair's shipped answers for the default pair,
          else an empty store that this process's replies fill; ``"none"``: no datastore; else
          a response cache file (dflash-train's JSONL, gzipped or not).
        model: The tool's ``--model`` (None: the default pair).
        vocab: The target's vocabulary size.
        settings: :class:`dflash_mlx.drafts.datastore.Datastore`'s (``learns=False``: replies
          do not join it).

    Raises:
        DFlashError: If the file is missing or is no response cache.
    """
    from ..drafts.datastore import Datastore, load_datastore
    from ..loading.pairs import DEFAULT_PAIR, embedded_pair_path, is_embedded_pair

    if choice == "none":
        return None
    if choice in (None, "auto"):
        default = is_embedded_pair(model) and embedded_pair_path(model or DEFAULT_PAIR) == embedded_pair_path()
        path = default_pair_answers() if default else None
        if path is None or not path.is_file():
            return Datastore(None, vocab, **settings)
    else:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise DFlashError(
                f"--datastore {choice}: no such file. Pass a response cache (dflash-train's JSONL, "
                "optionally gzipped), 'auto' or 'none'."
            )
    return load_datastore(path, vocab, **settings)


def add_stop_tokens(tokenizer, tokens: list[str]) -> None:
    """Make each of ``tokens`` (a token's text or id) end generation, as mlx-lm's ``--extra-eos-token``.

    Raises:
        DFlashError: For text that is not one token of this tokenizer, or an id outside its vocabulary.
    """
    vocab = tokenizer.get_vocab()
    ids = set(vocab.values())
    for token in tokens:
        token_id = int(token) if token.lstrip("-").isdigit() else vocab.get(token)
        if token_id is None or token_id not in ids:
            raise DFlashError(
                f"--extra-eos-token {token!r} is not a token of this tokenizer; pass a token's exact text "
                "(e.g. '<|im_end|>') or its id."
            )
        tokenizer.add_eos_token(str(token_id))


@dataclass
class Session:
    """A loaded pair and what the tools keep beside it between calls.

    Build one with :meth:`open` (from a tool's flags) or directly from a pair already loaded
    (``dflash_mlx.load``'s three values: a server's ranks, tests).

    Args:
        model, draft, tokenizer: The pair; ``draft`` None means plain decoding.
        model_path: The ``--model`` it was loaded from (None: the default pair), for the datastore.
        draft_path: The drafter it was asked to load (after the choice of :meth:`open`: ``"auto"``
          for a known target's official drafter; None: the pair folder's, or none).
        datastore: What cycles draft from besides the drafter and the prompt
          (:func:`open_datastore`); None: nothing.
        policy_store: Where the adaptive policy's states are kept between processes; None: only
          in this session (``policies``).
        policies: The adaptive policy's state per drafting setup (:meth:`policy`), passed as
          ``policy=`` to every call with that setup, so a new reply goes on from the last.
    """

    model: Any
    draft: Any
    tokenizer: Any
    model_path: str | None = None
    draft_path: str | None = None
    datastore: "Datastore | None" = None
    policy_store: PolicyStore | None = None
    policies: dict[str, PolicyState] = field(default_factory=dict)
    _stored: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # setup -> key in the store

    @classmethod
    def open(
        cls,
        model: str | None = None,
        draft: str | None = None,
        *,
        no_draft: bool = False,
        known_draft: bool = True,
        dtype: str | None = None,
        kernels: str = "auto",
        parallel: str | None = None,
        pipeline_split: list[int] | None = None,
        extra_eos_token: Sequence[str] = (),
        policy_store: PolicyStore | None = None,
    ) -> "Session":
        """Choose the drafter, load the pair and add the stop tokens.

        Args:
            model, draft, no_draft, dtype, extra_eos_token: The tools' flags of those names.
            known_draft: Give a known target without ``draft`` its official drafter
              (:func:`dflash_mlx.loading.registry.draft_for_cli`); False loads what was given
              (dflash-bench measures the pair as named).
            kernels, parallel, pipeline_split: See :func:`dflash_mlx.load`.
            policy_store: See the class.

        Raises:
            DFlashError: For a pair that cannot be loaded or an unknown stop token.
        """
        from ..loading import loading
        from ..loading.registry import draft_for_cli

        if known_draft:
            draft = draft_for_cli(model, draft, no_draft)
        target, drafter, tokenizer = loading.load(
            model, draft, dtype=dtype, kernels=kernels, parallel=parallel, pipeline_split=pipeline_split
        )
        if extra_eos_token:
            add_stop_tokens(tokenizer, list(extra_eos_token))
        return cls(target, None if no_draft else drafter, tokenizer, model, draft, policy_store=policy_store)

    @property
    def vocab_size(self) -> int:
        from ..models.target import vocab_size

        return vocab_size(self.model)

    def open_datastore(self, choice: str | None, **settings) -> "Datastore | None":
        """Open ``--datastore`` (:func:`open_datastore`) for this pair; plain decoding stays plain
        (no drafter: none). Returns it, kept as ``datastore``."""
        if self.draft is not None:
            self.datastore = open_datastore(choice, self.model_path, self.vocab_size, **settings)
        return self.datastore

    def make_cache(self, *, max_kv_size: int | None = None, **window):
        """A fresh pair cache (:func:`dflash_mlx.loop.cache.make_cache`; ``window``: its
        ``draft_window``/``draft_sinks``).

        ``max_kv_size``: a target cache that keeps only the last this many tokens (mlx-lm's
        rotating cache), for plain decoding only: it never rolls back. Prefilled with mlx-lm's
        step (2048), it gives ``mlx_lm generate``'s output (see ``Verifier.prefill``).
        """
        from ..loop.cache import DFlashCache, make_cache

        if max_kv_size is not None:
            from mlx_lm.models.cache import make_prompt_cache

            from ..models.stages import own_split
            from ..models.target import decoder

            if own_split(decoder(self.model)):
                raise DFlashError(
                    "--max-kv-size runs mlx-lm's own pass, which cannot run a target split as a pipeline by "
                    "DFlash: leave --max-kv-size out, or pass --tensor-parallel."
                )
            return DFlashCache(make_prompt_cache(self.model, max_kv_size=max_kv_size))
        return make_cache(self.model, self.draft, **window)

    def policy(self, setup: dict, **settings) -> PolicyState:
        """The adaptive policy's state for a drafting ``setup`` (a JSON-able dict of what its
        verdict depends on), the same object each time; from the store when the session has one
        and the drafter is a DFlash drafter, else fresh with ``settings`` (PolicyState's)."""
        from ..models.drafter import DraftModel
        from ..tuning.policy import policy_key

        name = json.dumps(setup, sort_keys=True, default=str)
        if name not in self.policies:
            if self.policy_store is not None and isinstance(self.draft, DraftModel):
                key = self._stored[name] = policy_key(self.model, self.draft, setup)
                self.policies[name] = self.policy_store.get(key, **settings)
            else:
                self.policies[name] = PolicyState(**settings)
        return self.policies[name]

    def keep_policies(self) -> None:
        """Write the states of the stored setups back to the policy store."""
        for name, key in self._stored.items():
            self.policy_store.put(key, self.policies[name])

    def stream(self, prompt: str | list[int], *, setup: dict | None = None, **kwargs) -> Iterator:
        """:func:`dflash_mlx.stream_generate` on the pair, drafting from the session's datastore.

        Args:
            prompt: As ``stream_generate``'s.
            setup: The drafting setup whose adaptive policy state the call goes on from and updates
              (:meth:`policy`); None: ``kwargs``' own ``policy``, if any.
            kwargs: ``stream_generate``'s (``prompt_cache``, sampling, ...).
        """
        from ..generation import stream_generate

        if setup is not None:
            kwargs["policy"] = self.policy(setup)
        return stream_generate(self.model, self.draft, self.tokenizer, prompt, datastore=self.datastore, **kwargs)

    def generate(self, prompt: str | list[int], *, setup: dict | None = None, **kwargs) -> str:
        """:func:`dflash_mlx.generate` on the pair, as :meth:`stream`."""
        from ..generation import generate

        if setup is not None:
            kwargs["policy"] = self.policy(setup)
        return generate(self.model, self.draft, self.tokenizer, prompt, datastore=self.datastore, **kwargs)
