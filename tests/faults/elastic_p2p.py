"""A point-to-point wait inside hp.elastic.run whose peer dies (tests/test_elastic_inprocess.py, the long case): on
2 ranks rank 1 SIGKILLs itself while rank 0 waits for its message; rank 0's wait raises RanksLostError naming rank 1,
and hp.elastic.run goes on with rank 0 alone (the state rolled back: its second call counts 1 again)."""

from __future__ import annotations

import os
import signal
import time

import hybridpipe as hp
from hybridpipe.comm import p2p


def main() -> None:
    hp.init()
    state = hp.elastic.ObjectState(calls=0)

    @hp.elastic.run
    def work(state: hp.elastic.ObjectState) -> None:
        state.calls += 1
        if hp.size() == 1:
            with open(os.environ["OUT"], "a") as out:
                out.write(f"alone: rank {hp.rank()} of {hp.size()} after {state.calls} calls\n")
            return
        if hp.rank() == 1:
            time.sleep(0.5)  # rank 0 is in its wait by then, usually
            os.kill(os.getpid(), signal.SIGKILL)
        try:  # the post too: on a loaded machine the failure may be known before it
            p2p.Receive(1, 5, hp.grid().world_comm).wait(what="a message that never comes")
        except hp.RanksLostError as error:  # into a file: mpirun may drop output sent while it handles the failure
            with open(os.environ["OUT"], "a") as out:
                out.write(f"wait raised {type(error).__name__} ranks={error.ranks}: {error}\n")
            raise

    work(state)
    hp.shutdown()


if __name__ == "__main__":
    main()
