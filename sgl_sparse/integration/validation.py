"""Request validation in the HTTP process of sgl_sparse servers, before anything reaches the scheduler.

SGLang 0.5.17 forwards some bad requests to the scheduler unchecked. A negative token id in
``input_ids`` raises in the scheduler's embedding lookup, which takes the whole server down (vanilla
too). An id equal to the vocab size is served on padded embeddings. ``text`` with ``input_ids`` is
ambiguous: the batch size comes from ``text`` and the prompt from ``input_ids``. And ``custom_params``
is not checked at all, though it is where per-request sgl_sparse settings travel.

The hook is a BEFORE hook on ``TokenizerManager.generate_request``. Every generation request goes
through it: ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` and ``Engine.generate``.
The hook runs when the generator is created, which is before SGLang normalises the batch,
allocates request state, or sends anything to the scheduler. A whole batch is therefore rejected
before any of its items is sent. (SGLang's ``_validate_one_request`` runs per item, and in a
sequential batch the earlier items have already been sent by the time a later one fails.) SGLang
turns the ``ValueError`` into HTTP 400 on ``/generate`` and on the OpenAI routes, for both streaming
and non-streaming OpenAI requests. A *streaming* ``/generate`` request gets HTTP 200 with an error
event (``"code": 400``), because that route starts streaming before it runs the generator; SGLang's
own validation errors behave the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sgl_sparse.integration import BACKEND_NAME
from sgl_sparse.request_methods import (
    KEYS,
    PRUNE_KEY,
    MethodResolver,
    RequestMethodError,
    parse_prune_param,
    prune_problem,
)

CUSTOM_PARAMS_PREFIX = "sgl_sparse_"
# The custom_params keys that sgl_sparse reads (per-request methods, sgl_sparse/request_methods.py). Any
# other key with the prefix is a typo, so it is rejected instead of being ignored.
KNOWN_CUSTOM_PARAMS: frozenset[str] = KEYS | {PRUNE_KEY}

_SCALARS = (str, int, float, bool, type(None))


class RequestValidationError(ValueError):
    """A request rejected before tokenization. It subclasses ValueError because that is what SGLang's
    HTTP handlers turn into status 400."""


def validate_generate_input(text: Any, input_ids: Any, sampling_params: Any, vocab_size: int,
                            resolver: MethodResolver | None = None,
                            text_len: Callable[[str], int] | None = None) -> None:
    """Raise :class:`RequestValidationError` if a raw (not yet normalised) ``GenerateReqInput``
    is bad. The inputs are its fields as the client sent them. Each may be a single value or a
    batch: ``input_ids`` as ``list[int] | list[list[int]]``, ``sampling_params`` as
    ``dict | list[dict]``. Shapes and types that SGLang checks itself are left to SGLang. With a
    ``resolver``, a per-request method choice must be one the server can serve, and a per-request prune
    (``sgl_sparse_prune``) must fit the prompt, whose length ``text_len(text)`` gives for a text prompt."""
    if text is not None and input_ids is not None:
        raise RequestValidationError(
            "text and input_ids are mutually exclusive: send the prompt either as text or as input_ids"
        )
    if input_ids is not None:
        _check_input_ids(input_ids, vocab_size)
    def prompt_len(i: int | None) -> int | None:
        """The length of prompt ``i`` (``None``: the single prompt) where the HTTP process knows it."""
        ids = input_ids if i is None or not isinstance(input_ids, Sequence) else (
            input_ids[i] if i < len(input_ids) and isinstance(input_ids[i], Sequence) else None)
        if isinstance(ids, Sequence) and ids and not isinstance(ids[0], Sequence):
            return len(ids)
        t = text if i is None or not isinstance(text, list) else (text[i] if i < len(text) else None)
        return text_len(t) if isinstance(t, str) and text_len is not None else None

    if isinstance(sampling_params, Mapping):
        cp = sampling_params.get("custom_params")
        _check_custom_params(cp, "custom_params", resolver,
                             prompt_len(None) if isinstance(cp, Mapping) and PRUNE_KEY in cp else None)
    elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
        for i, sp in enumerate(sampling_params):
            if isinstance(sp, Mapping):
                cp = sp.get("custom_params")
                _check_custom_params(cp, f"sampling_params[{i}].custom_params", resolver,
                                     prompt_len(i) if isinstance(cp, Mapping) and PRUNE_KEY in cp else None)


def _check_input_ids(input_ids: Any, vocab_size: int) -> None:
    if not isinstance(input_ids, Sequence) or not input_ids:
        return  # SGLang rejects these itself ("input_ids cannot be empty", or pydantic's type errors)
    if isinstance(input_ids[0], Sequence):
        for b, seq in enumerate(input_ids):
            _check_sequence(seq, vocab_size, f"input_ids[{b}]")
    else:
        _check_sequence(input_ids, vocab_size, "input_ids")


def _check_sequence(seq: Any, vocab_size: int, where: str) -> None:
    if not isinstance(seq, Sequence) or not seq:
        return
    try:
        in_range = 0 <= min(seq) and max(seq) < vocab_size  # C-speed scan; locate the offender only on failure
    except TypeError:
        return  # not all ints: leave it to SGLang's own type checks
    if in_range:
        return
    pos, tok = next((i, t) for i, t in enumerate(seq) if not 0 <= t < vocab_size)
    raise RequestValidationError(
        f"{where}[{pos}] = {tok} is not a token id of this model: valid token ids are in "
        f"[0, {vocab_size}) (vocab size {vocab_size})"
    )


def _check_custom_params(custom_params: Any, where: str, resolver: MethodResolver | None = None,
                         prompt_len: int | None = None) -> None:
    if custom_params is None:
        return
    if not isinstance(custom_params, Mapping):
        raise RequestValidationError(f"{where} must be a JSON object, got {type(custom_params).__name__}")
    for key, value in custom_params.items():
        if isinstance(key, str) and key.startswith(CUSTOM_PARAMS_PREFIX) and key not in KNOWN_CUSTOM_PARAMS:
            known = ", ".join(sorted(KNOWN_CUSTOM_PARAMS)) or "none yet"
            raise RequestValidationError(
                f"{where}: unknown key {key!r}; known {CUSTOM_PARAMS_PREFIX}* keys: {known}"
            )
        if not _is_custom_param_value(value):
            raise RequestValidationError(
                f"{where}[{key!r}] is nested too deeply: a value must be a JSON scalar, a list of scalars "
                "or an object of scalars (JSON-encode deeper structures into a string)"
            )
    if resolver is not None:
        try:
            resolver.resolve(custom_params)
            if PRUNE_KEY in custom_params:
                spec = parse_prune_param(custom_params[PRUNE_KEY], prompt_len)
                if (why := prune_problem(resolver, spec)) is not None:
                    raise RequestMethodError(PRUNE_KEY, why)
        except RequestMethodError as e:
            raise RequestValidationError(f"{where}[{e.key!r}]: {e}") from None


def _is_custom_param_value(value: Any) -> bool:
    """SGLang's own type for a custom_params value (``CustomParamValue``, sampling_params.py L28-37):
    a JSON scalar, a list of scalars, or a flat object of scalars. The msgspec IPC
    (``SGLANG_USE_PICKLE_IPC=0``) rejects anything deeper in the scheduler, and that kills the server.
    Lists and flat objects are allowed because SGLang's built-in logit processors take them (for example
    ``token_ids`` in ``DisallowedTokensLogitsProcessor``)."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _SCALARS) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in value.items())
    return False


def before_generate_request(tm: Any, obj: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``TokenizerManager.generate_request(self, obj, request=None)``. It acts only in servers
    whose radix cache is ours; every other TokenizerManager in the process is left alone."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = kwargs.get("obj", obj)
    if tm.server_args.radix_cache_backend != BACKEND_NAME or not isinstance(obj, GenerateReqInput):
        return
    # model_config.vocab_size is the bound SGLang itself checks token ids against
    # (token_ids_logprob, SamplingParams.verify in tokenizer_manager.py).
    from sgl_sparse.integration import handoff

    # A text prompt's length, for a per-request prune's bounds, as the TokenizerManager will tokenize it.
    validate_generate_input(obj.text, obj.input_ids, obj.sampling_params, tm.model_config.vocab_size,
                            handoff.resolver(), lambda t: len(tm.tokenizer.encode(t)))


TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
