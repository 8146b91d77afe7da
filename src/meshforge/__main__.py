import os
import sys

from meshforge.cli import main

code = main()
if "RANK" in os.environ:  # a rank started by a launcher: end without interpreter finalisation (launch.exit_process)
    from meshforge.launch import exit_process

    exit_process(code)
sys.exit(code)
