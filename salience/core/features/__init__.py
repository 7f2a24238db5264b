"""Features of the residual stream: sparse autoencoders (SAEs) read from and written to
SAELens's folder format (sae.py), and the encoder the layer taps run (encoder.py). Imports
nothing of Salience's but `salience.errors`.
"""

__all__: list[str] = []
