"""``python -m tests.elastic_launcher ARGS``: ``torchrun ARGS`` whose agent waits at most 10 s at
exit for the other nodes' agents (torch's default is 300 s). A node whose agent was sent SIGTERM
never reaches that exit barrier, so without this the other node's agent would idle five minutes
after its workers have finished (``tests/test_multinode.py``)."""

import functools

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.run import main

EXIT_BARRIER_SECONDS = 10

if __name__ == "__main__":
    LocalElasticAgent.__init__ = functools.partialmethod(LocalElasticAgent.__init__,
                                                         exit_barrier_timeout=EXIT_BARRIER_SECONDS)
    main()
