"""Integrations of moe_ops with other libraries.

`moe_ops.integrations.transformers`: the Hugging Face transformers experts implementation
(`register()` adds "moe_ops" to transformers' experts-implementation registry). Submodules are
imported on demand, so `import moe_ops` never imports transformers.
"""
