"""Salience: an inference server over vLLM with concept readouts."""
