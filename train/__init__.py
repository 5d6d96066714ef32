"""TokenButler predictor training: presets (predictor.py), data streams (data.py), the training loop (loop.py) and
the `jsparse train-predictor` command (cli_train.py). The predictor module itself lives in
`jsparse.methods.butler_predictor` (the `butler` method runs it at inference; the library never imports train/)."""
