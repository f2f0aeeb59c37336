"""Imported only by the DataLoader's forkserver (its preload list, dflash/train/loader.py): the
forkserver dies when the training process that started it dies, even by SIGKILL, and the loader workers
it forks die with it (`loader._worker_init`).  Without this a killed trainer would leave the forkserver
and its workers running, holding the store's files and the batch slots' shared memory."""

from dflash.spawned import die_with_parent

die_with_parent()
