"""Advantage estimators, policy losses (ppo_clip, clip_cov, kl_cov), regularisers, aggregation."""
