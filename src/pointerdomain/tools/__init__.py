"""Tools on top of the library: the command line (``pointerdomain``), doctor, demo,
whatis and the explanation of an address."""
