"""The bundled demo: the GPT job that ``openhosti train``, the examples and the benchmarks run
(``openhosti_jax.demo.gpt_job``), and the planner's example models (``openhosti_jax.demo.examples``).

It sits above every engine and `openhosti_jax.train`, below only the CLI; the pure model code it trains is
`openhosti_jax.models`.
"""
