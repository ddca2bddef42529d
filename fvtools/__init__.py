"""Generic training methods over the WorldPlay model (docs/methods/overview.md): flat scripts `train_<method>.py`,
each its recipe, run as `python fvtools/train_<method>.py` or through `tools/launch_fvtools_<method>.sh`."""
