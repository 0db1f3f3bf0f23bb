"""`python -m client "prompt"`: stream a completion from the Tritium model in tritonserver."""
import sys

from tritium.client.cli import main

sys.exit(main())
