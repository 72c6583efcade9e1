"""Optional integrations with engines that run models: each needs its engine (and PyTorch),
imported when the integration is used, never by ``import splitkv``.

- ``splitkv.integrations.torch_ops``: the decode call as a PyTorch custom op
  (``torch.ops.splitkv.paged_decode``), traceable by ``torch.compile(fullgraph=True)``; the
  three engine integrations call it.
- ``splitkv.integrations.transformers``: the ``"splitkv"`` attention implementation for Hugging
  Face transformers' continuous batching (``model.generate_batch``), 5.17 and later.
- ``splitkv.integrations.vllm``: a vLLM v1 attention backend (``--attention-backend SPLITKV``),
  loaded from the ``vllm.general_plugins`` entry point.
- ``splitkv.integrations.sglang``: an SGLang attention backend
  (``--decode-attention-backend splitkv``), loaded from the ``sglang.srt.plugins`` entry point.
"""
