"""Word lists written for the generated tasks (RULER draws its words from `wonderwords`, which is not a
dependency here): concrete English nouns and adjectives, lowercase, no word inside another.

NOUNS     needle values of niah_single_word, second halves of needle keys, the word pool of cwe
ADJECTIVES first halves of needle keys ("{adjective}-{noun}", as RULER's keys), also in cwe's pool
"""

from __future__ import annotations

NOUNS = tuple("""
anchor apricot avalanche backpack badger balcony bamboo banjo barrel basket beacon beetle biscuit blanket
blizzard bonfire bracelet breeze bucket buffalo butterfly cabbage cactus camel candle canoe canyon carpet
carrot castle caterpillar cathedral cello cherry chimney cinnamon circus clarinet cliff cobweb coconut comet
compass cottage cricket crystal cucumber cupboard dagger daisy dolphin donkey dragon drizzle eagle eclipse
elephant emerald falcon feather ferry fiddle firefly flamingo flute fountain fox garlic geyser ginger giraffe
glacier goblet gondola gorilla granite grape guitar hammock harbor harp hazelnut hedgehog helmet hippo honey
hurricane iceberg igloo island jacket jaguar jasmine jellyfish jungle kangaroo kettle kiwi koala ladder lagoon
lantern lemon leopard lettuce lighthouse lizard lobster magnet mango maple marble meadow melon meteor mirror
monkey mosquito mountain mushroom napkin nectar needle nutmeg oasis octopus olive orchid ostrich otter oyster
paddle pagoda panther parrot peacock peanut pebble pelican penguin pepper piano pillow pineapple pistachio
planet pumpkin puzzle quilt rabbit raccoon radish rainbow raven reindeer ribbon robin rocket saddle
salmon sandal sapphire saxophone scarecrow scorpion seagull shovel skeleton sled sparrow spider spinach
squirrel stapler statue strawberry submarine sunflower swan telescope thimble thunder tiger tomato tornado
tortoise trumpet tulip turnip umbrella unicorn valley vanilla violin volcano walnut walrus waterfall
whale whistle willow windmill wizard yacht zebra zucchini
""".split())

ADJECTIVES = tuple("""
ancient brave bright brisk bumpy calm careful cheerful chilly clever cloudy clumsy cozy crispy curious
dainty dusty eager elegant faint fancy fierce fluffy foggy fragile frosty gentle giant gloomy glossy
graceful grumpy hasty hollow humble jolly lively lonely lucky massive mellow merry mighty misty modest
muddy narrow noble noisy nimble odd patient plump polite proud quiet quirky rapid rusty sandy shaggy shiny
silky silly sleepy slender sly smooth snowy sparkling speedy spicy steady sticky stormy sturdy sunny swift
tender thirsty tidy tiny tricky velvety vivid wary weary wild witty wobbly wooden young zesty
""".split())
