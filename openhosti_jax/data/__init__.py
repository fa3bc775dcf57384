"""Bundled data sources: resumable iterators whose position is a small JSON dict (`StatefulIterator`)."""

from openhosti_jax.data.array import ArrayDataset
from openhosti_jax.data.grain_iter import GrainIterator
from openhosti_jax.data.protocol import StatefulIterator, check_json_state

__all__ = ["ArrayDataset", "GrainIterator", "StatefulIterator", "check_json_state"]
