"""Pure model code: GPT, Llama, a BERT encoder classifier, an SDXL-layout UNet, attention kernels, published shapes
as presets.

It needs only the lower layers (errors, policies, sharding rules, state's block stacking); the demo job that trains
these models is `openhosti_jax.demo`.
"""
