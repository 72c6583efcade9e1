"""Optional integrations with engines that run models: each needs its engine (and PyTorch),
imported when the integration is used, never by ``import splitkv``.

- ``splitkv.integrations.torch_ops``: the decode call as a PyTorch custom op
  (``torch.ops.splitkv.paged_decode``), traceable by ``torch.compile(fullgraph=True)``.
- ``splitkv.integrations.transformers``: the ``"paged|splitkv"`` attention implementation for
  Hugging Face transformers' continuous batching (``model.generate_batch``).
"""
