"""``splitkv`` as an SGLang attention backend, found through the ``sglang.srt.plugins`` entry
point (pyproject.toml), so no fork of SGLang is needed:

    pip install splitkv[sglang]
    python -m sglang.launch_server --model ... \\
        --decode-attention-backend splitkv --prefill-attention-backend fa3

splitkv decodes; prefill (extend) batches need a backend of their own, which SGLang runs beside
splitkv when the two flags differ. SGLang calls :func:`register` in each of its processes, so it
imports nothing of splitkv's GPU side (no torch or CuPy of splitkv's own): the backend module is
imported when SGLang builds the backend (:func:`create_backend`).
"""

from __future__ import annotations

NAME = "splitkv"


def register(name: str = NAME) -> str:
    """Register ``name`` in SGLang's attention registry and its CLI choices; returns the name.
    Calling it again changes nothing."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(name)(create_backend)
    if name not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([name])
    return name


def create_backend(model_runner):
    """The factory SGLang calls with its model runner when it builds the attention backend."""
    from .backend import SplitKVAttnBackend

    return SplitKVAttnBackend(model_runner)
