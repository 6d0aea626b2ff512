"""The entropy-performance law, plots of a run's metrics and the study that reproduces the
paper's figures at toy scale. Nothing is re-exported here: the config tree imports the study's
settings (study_settings.py) without loading numpy or the analysis itself."""
