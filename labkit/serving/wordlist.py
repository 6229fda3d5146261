"""The 1,024 words `labkit serve` streams as its generated tokens (one word, with a leading space, per token).

Each is a single token of SmolLM2's tokenizer, and any sequence of them re-tokenizes to one token per word
(`tests/test_engine_server.py` checks both with the real tokenizer): the 1,024 lowest-id tokens of SmolLM2's
vocabulary that are a space and a lowercase word found at least 20 times in the Shakespeare texts the quality
lab uses. Common words of this kind are single tokens of most byte-level BPE vocabularies too (not checked
here: no other tokenizer is installed).
"""

WORDS = tuple("""
the in of and to is be for on that you as with an or it are de he we by can at ha le from was not this have us your
their they all will which do more me other has man about but out one if so were also part them up who into these
some how self when his our may time under there than go over know people like act year such been use help new what
would need through am work any ass had off most no many add used only first child get between two learn where could
health should her well every high world even form water sign just make years set call my see then those way each
because effect while found art count long after return read cur lead life very being own she find understand right
person back both follow writ does grow much main before level study great end food start children good might school
within often made said show same too power again small allow care less example down take day human now state called
point number build play though body did must him common want met three cell pass let govern known without public
still change better hand another report place learning interest present sit list feel cap light become open mean few
keep others best direct name history create top leg perform home proper stand et move among something mark look
things large think air against law means rest here provide particular several women pain due object old current try
beg early together access last turn disease success making possible low say key certain run land blood case since
head post along value order come government following why addition cost times profess cause able toward view course
else prevent press hard line special consider natural plant language until second country men young works always put
mar step given strong little age ways business book next far flow four short working past space ill sing free heart
war conditions says needs words give paper kind mind having field begin expect question knowledge changes appear
story upon require whether ask temper enough likely record days makes away sum further ever going left account
employ lay higher big full increase sure never side brain death term ground above event least maintain subject sound
near affect dam rather effects reason quality nature practice loss hold lower general comes meet already word simple
regard city living single wind themselves towards respect either once seen thought deep according pay house done cut
fail aspect live fall action sent quick break society soft red writing rights sun mass parts seem lives sometimes
yet share rate came approach friends clear below image whole meaning services taken continue music money avoid
taking tell cannot five white reading check except harm doing skin itself began sense week love remain weight la
condition measure offer content true accept matter black draw bring took sat cat feed instance green terms conduct
express dat fish months provided face forms company elements hours almost shows half yourself aim bar service fat
soil claim dog thing commit close sleep easy enjoy heat spread travel led issue longer greater stop written wild
lands believe points slow fire behind books ones remember custom takes safety stay daily write numbers growing six
policy answer safe late looking page talk thinking shape visit cross shown camp earl beyond force warm lo lack quite
town earth attempt quickly cover request everything cool pack inform game eat forest easily ago patient base night
host search wood civil poor gain tree difference serious ancient lines becomes fit table tend remains powerful feet
speak hands friend steps bad thus soon directly eye spirit determine got waste diseases places foot mother hot held
trees seems sea rich front nation journey purpose whose rob sold third raise perfect reach therefore device learned
eyes dry memory fair load went demand length choose month anything fast speed although fight mount supply command
room lost habit wide dark bound brought carry stage dim trust actions season private doctor forces received news saw
birth date discover fear forward fields laws reasons leaves message infection benefit teach trade root won ten
challenge told shall deal receive piece serve degree hundred hope names constant moment task rare concerns nothing
middle burn gives dead save himself leave goes rule weather guide miss fresh heard box born divers cold perhaps
alone summer rock peace equal worth distance setting wrong teeth north father rise running note figure signs watch
son instruct bodies enter profession giving joint comfort lived master woman coming cry picture choice king south
contract gold faith weak citizens died famous store birds strength former presence price feeling winter remove fruit
foreign direction letter mouth advance hair ready pen glass despite bond sort pieces train conclusion blue bed
thoughts chance eight garden gave staff manage medicine error native church appears walk wonder plays truth buy
heavy felt sounds office height river turned notes iron metal win party leads meeting breast justice freedom court
huge speech milk seek bottom star hear notice carried grant secret spring wall drive moved familiar thick song spent
gather seven meant saying fine served arm title advice cast dogs plot ocean mere letters round send wealth looks
injury flood purposes destroy confirm aid advantage ourselves god straight meat dangerous battle credit possess sets
otherwise apart subjects push rain secure argument voice nor intelligence taught looked noted whom knew spend
talking authority hour answers please charge hearing grass killed hit stream excellent truly salt smooth tooth
island die knows yield brief kept deliver exchange goods flowers firm motion follows double flat youth ship happy
edge thin bird kill begins abuse careful tried waters storm bright stone prepare window stars manner brother lies
yellow loved morning pretty skill join match bow drop instrument pray wear walls wet snow poverty sudden moral
drinking west wait serves fill sides chain touch speaking audience matters paid lose sell park grown drink band
torch wants trial opinion sin knowing catch afford apparent calls acts beauty gar stock hunt attend shapes waves
stronger shift frame
""".split())
