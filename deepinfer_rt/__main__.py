"""`python -m deepinfer_rt ...` is the `deepinfer` command."""
import sys

from deepinfer_rt.cli import main

sys.exit(main())
