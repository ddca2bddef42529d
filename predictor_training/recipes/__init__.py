"""Recipe wiring that several entry scripts share (the top layer: it may import every other one; the scripts
themselves stay outside the package). `offline.py`: the offline recipe's flags and build, used by
train_predictor_v4.py and train_predictor_disca.py."""
