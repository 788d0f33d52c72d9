from agentkv._main import main

main()
