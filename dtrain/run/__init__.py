"""A training run, in the order it happens: preflight checks (run dir, resume), the run built
once (build.py), then the loop in dtrain.train, which saves through saving.py and reports each
logged step through report.py."""
