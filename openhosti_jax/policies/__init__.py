"""Policies applied across a training step: rematerialisation and mixed precision."""
