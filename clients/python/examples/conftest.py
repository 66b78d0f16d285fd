# The package from this checkout (clients/python/leasehold), so that the examples' tests run
# without installing it; an installed package needs no such line.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
