"""splitkv as a vLLM (v1) attention backend, selected with ``--attention-backend SPLITKV``.

vLLM loads the ``vllm.general_plugins`` entry point (``splitkv =
splitkv.integrations.vllm:register``) in every one of its processes, before it parses the
arguments, so :func:`register` runs there: it records only the backend's class path in vLLM's
registry and imports nothing of torch, CuPy or splitkv's runtime (vLLM imports the class, from
``splitkv.integrations.vllm.backend``, when a model's attention layers are built).

The name is a registry member of splitkv's own: vLLM 0.33's ``register_backend`` given a new
name (a string, not a member) adds it to ``AttentionBackendEnum``, so the one ``CUSTOM`` slot
stays free for other plugins. The backend's ``get_name()`` returns the same name (the attention
layer looks its backend up by it).
"""

from __future__ import annotations

NAME = "SPLITKV"
CLASS_PATH = "splitkv.integrations.vllm.backend.SplitKVBackend"


def register() -> str:
    """Add ``SPLITKV`` to vLLM's attention backends (again: point it at splitkv's class);
    returns the name. Safe to call more than once per process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME in AttentionBackendEnum.__members__:     # registering a name twice raises
        register_backend(AttentionBackendEnum[NAME], CLASS_PATH)
    else:
        register_backend(NAME, CLASS_PATH)
    return NAME
