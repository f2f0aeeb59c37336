"""The target: reading its checkpoint files (files: config, identity, embedding and lm_head) and
running it to capture hidden states at chosen layers (capture).  Shared by precompute, train and evaluate.
"""
