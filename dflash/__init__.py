"""dflash: train DFlash speculative-decoding drafters from an offline store of target hidden states."""

__version__ = "0.1.0"
