"""`python -m trainyard`: the same as the `trainyard` command."""
import sys

from trainyard.cli import main

sys.exit(main())
