"""Data side of the toolkit: the sample table (cases x standard actions, splits), encoders, shards and datasets."""
