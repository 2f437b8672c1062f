"""Entry point: `python -m learner_agent run --config PATH [--detach]` (see learner_agent.agent), or
`python -m learner_agent spare --fifo PATH` (see learner_agent.spare)."""
import sys

from learner_agent.agent import main

if __name__ == "__main__":
    sys.exit(main())
