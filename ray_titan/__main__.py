import sys

from ray_titan.cli import main

sys.exit(main())
