"""The entropy-performance law, plots of a run's metrics and the study that reproduces the
paper's figures at toy scale (the study's settings are the config tree's: config/study.py).
Nothing is re-exported here: the commands load only the module they run."""
