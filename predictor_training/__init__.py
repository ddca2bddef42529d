"""Predictor toolkit: train and evaluate a small Predictor that replaces denoising steps of the WorldPlay Teacher."""
