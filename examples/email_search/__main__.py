from .._common import run_from_command_line
from . import main

run_from_command_line(main)
