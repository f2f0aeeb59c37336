"""After training: measure a drafter (run: offline tau, online speculative decoding), export it in the
format the serving engines load (export), plot the results (plots).
"""
