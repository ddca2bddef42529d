"""Recipe wiring that several entry scripts share (the top layer: it may import every other one; the scripts
themselves stay outside the package). `offline.py`: the offline recipe's flags and build, used by
train_predictor_v4.py and train_predictor_disca.py; `rollout.py`: the rollout recipe's step and build;
`{df_sft,kd,dmd2,adversarial,nft}.py`: each fvtools method's step and build (the scripts keep flags and `main()`)."""
