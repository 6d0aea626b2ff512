"""The commands that start and prepare jobs: the Slurm helpers of the sbatch scripts, ``plan``
and checkpoint conversion. Above the trainer: this layer may import the config and the engines;
nothing below imports it."""
