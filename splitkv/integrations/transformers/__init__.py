"""splitkv as an attention implementation of Hugging Face transformers' continuous batching
(``model.generate_batch``, ``ContinuousBatchingManager``), on transformers 5.17 and later.

    import splitkv.integrations.transformers as skv
    skv.register()                                  # once per process; returns "splitkv"
    model.set_attn_implementation("splitkv")        # or attn_implementation="splitkv" at load
    outputs = model.generate_batch(
        prompts, generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=True))

Decode-only batches run splitkv (planned on the device, so transformers' CUDA graphs capture
the plan with the forward); prefill and mixed batches run transformers' SDPA with a mask built
here. transformers turns CUDA graphs on by default only for flash attention names: pass
``use_cuda_graph=True``. :mod:`.registration` says what :func:`register` widens in
transformers, :mod:`.attention` what each call does, :mod:`.delegate` the batches it hands on.
"""

from .attention import (ROUTES, TOKEN_ROWS_LIMIT, LayerVariant, decode_route, next_slots,
                        paged_splitkv_attention, route_counts, token_row_tables, token_slots)
from .delegate import varlen_mask
from .registration import NAME, PAGED_NAME, register, registered_names, uses_paged_prefix

__all__ = ["NAME", "PAGED_NAME", "ROUTES", "TOKEN_ROWS_LIMIT", "LayerVariant", "decode_route",
           "next_slots", "paged_splitkv_attention", "register", "registered_names",
           "route_counts", "token_row_tables", "token_slots", "uses_paged_prefix",
           "varlen_mask"]
