"""The front doors for other frameworks, above `openhosti_jax.train`: `OptimizedDDP` for PyTorch
(``openhosti_jax.frontends.torch_ddp``; also ``openhosti_jax.OptimizedDDP``) and `Strategy` for Keras 3
(``openhosti_jax.frontends.keras``). The plumbing they stand on (DLPack tensors, loaders, torch lowering) is
`openhosti_jax.bridges`.

Nothing is imported here: torch, Keras and TensorFlow load only when a front door is imported.
"""
