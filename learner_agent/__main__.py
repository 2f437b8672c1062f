"""Entry point: `python -m learner_agent run --config PATH [--detach]` (see learner_agent.agent), or
`python -m learner_agent spare --fifo PATH [--idle-s S]` (see learner_agent.spare)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["spare"]:
        from learner_agent.spare import main
        sys.exit(main(sys.argv[2:]))
    from learner_agent.agent import main
    sys.exit(main())
